"""`python -m kvstore` is the `kvstore` command."""
import sys

from kvstore.subcommands import main

sys.exit(main())
