"""The vocabulary every layer shares: typed errors, URL options, handles."""
