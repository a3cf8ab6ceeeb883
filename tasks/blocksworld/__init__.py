"""Blocksworld (PDDL blocksworld-4ops): the simulator, natural-language rendering and parsing, an optimal
planner and instance generator, and a validator for data files and plans (python -m tasks.blocksworld)."""
