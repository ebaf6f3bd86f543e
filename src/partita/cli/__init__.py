"""The `partita` command: one small module per subcommand, registered in main.py."""
