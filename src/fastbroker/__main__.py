"""`python -m fastbroker`: the same as the `fastbroker` command."""

from fastbroker.cli import main

if __name__ == "__main__":
    main(prog_name="fastbroker")
