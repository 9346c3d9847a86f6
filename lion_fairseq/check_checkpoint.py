"""``python -m lion_fairseq.check_checkpoint CHECKPOINT...``: is each checkpoint readable, which model and
arch is it, and what to pass to fairseq to use it (``--user-dir``). Exit status 1 if one cannot be read."""
import sys

from .clear_errors import main

if __name__ == "__main__":
    sys.exit(main())
