"""Experience as it travels between services: the packed payload of a group's token arrays (payload.py)."""
