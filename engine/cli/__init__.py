"""The command line: the demo and `explain`."""
