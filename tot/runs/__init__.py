"""Run folders: a run's configuration read from Hydra (`config.py`), the loop over problems that writes
one result and one tree per problem and resumes (`run.py`), and the folder's files: its recorded
configuration (`folder.py`), lock (`lock.py`), results (`results.py`), saved trees (`saved.py`) and
every write (`output.py`). It imports the search library (tot/search/), `tasks` and `decoding`'s
public face, never the commands (tot/*.py).
"""
