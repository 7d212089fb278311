"""``python -m cudalab``: the ``cudalab`` command line (see :mod:`cudalab.cli`)."""

from cudalab.cli import main

raise SystemExit(main())
