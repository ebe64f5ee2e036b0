"""The broker server: the ZeroMQ front (service.py), the state machine (state.py) and the pieces it
composes: queue, journal (spool), prompt leases, batch leases, ingest, controls, client table."""
