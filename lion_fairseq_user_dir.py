"""``lion-fairseq-user-dir``: print the folder to pass to fairseq as ``--user-dir``.

A module outside the package, so that finding the folder does not import it: ``import lion_fairseq``
imports fairseq (about 4 s), and this command runs before every fairseq command a user types with it."""
import importlib.util
import os


def path() -> str:
    """The ``lion_fairseq`` package's folder, found without importing it."""
    spec = importlib.util.find_spec("lion_fairseq")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lion_fairseq is not installed in this Python: pip install -e . in the checkout "
                         "(README, Install), or pass the checkout's lion_fairseq folder as --user-dir")
    return os.path.abspath(list(spec.submodule_search_locations)[0])


def main() -> None:
    print(path())


if __name__ == "__main__":
    main()
