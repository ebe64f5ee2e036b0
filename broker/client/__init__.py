"""The broker's client side: role-split protocols (roles.py) and their ZeroMQ (sync.py), asyncio (aio.py) and
in-process (inproc.py) implementations; the address and status helpers components need."""
