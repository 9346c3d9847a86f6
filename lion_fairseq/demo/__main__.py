"""``python -m lion_fairseq.demo``: see :mod:`lion_fairseq.demo.cli`."""
from lion_fairseq.demo.cli import main

if __name__ == "__main__":
    main()
