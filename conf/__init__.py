"""The Hydra configuration: one yaml per option group (task, search, decoder, model, ...), the one
place an option's default and meaning are written, and `reference.py`, which renders them as
docs/configuration.md. It imports nothing of the project.
"""
