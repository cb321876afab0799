"""Executors: where an engine's workers run (uni: in its process; mp: a
process per rank), behind one interface."""
