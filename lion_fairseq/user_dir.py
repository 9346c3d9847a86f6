"""``lion-fairseq-user-dir`` prints the folder to pass as ``--user-dir`` when the package is pip-installed."""
import os


def path() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    print(path())


if __name__ == "__main__":
    main()
