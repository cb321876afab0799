"""Executors: where an engine's workers run (uni: in its process; mp: a
process per rank; ray: a Ray actor per rank, across a cluster's nodes),
behind one interface."""
