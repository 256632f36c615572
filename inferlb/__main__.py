"""``python -m inferlb``: the same as the ``inferlb`` command."""

from inferlb.cli import main

main()
