"""`python -m h3render ...`: the same command as `h3render ...` (for an environment whose scripts folder is not on
PATH)."""

from h3render.cli import main

if __name__ == "__main__":
    main()
