"""Data users bring and data we make: reading tables of rows (``tables.py``) and the synthetic tasks
with verifiable answers that `fleetrl init-data` writes (``tasks.py``)."""
