"""Starting processes and joining them into one job."""
