"""Who may do what to the broker: CURVE keys and roles (auth.py, keys.py), the permission table
(permissions.py), bounds on connections (guard.py) and the audit log (audit.py)."""
