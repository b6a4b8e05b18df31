"""The `xavier` command line: `up`, `generate`, `status`, `models make-tiny`."""
