"""Processes: the embedded launcher, how a child dies with it, scratch folders, leaving fast."""
