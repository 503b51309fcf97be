"""The benchmark workers: one process per compared system, started by the benches with the
python of the venv that system needs (which may not have specrt installed), speaking the
JSON-lines protocol of ``_protocol.py``. Each is a plain file: run as a script, Python puts
this folder first on ``sys.path`` and it finds its sibling ``_protocol``."""
