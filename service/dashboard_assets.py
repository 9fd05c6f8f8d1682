"""Which files make up the web dashboard, and where an installed package keeps them.

Apart from service.dashboard (which serves them) because the wheel's build hook, setup.py,
reads this file before any dependency is installed: it must import nothing but the
standard library.

A dashboard directory holds ``app/`` (dashboards/app in a checkout) and, under
``node_modules/<package>/dist``, the files of each npm package that the app loads. A wheel
carries one such directory inside the ``service`` package, named ``PACKAGE_DIR``.
"""

from __future__ import annotations

# The files of each npm package that the app loads, under node_modules/<package>/dist.
VENDOR_FILES = ("uplot/uPlot.esm.js", "uplot/uPlot.min.css")
# The dashboard's directory inside the installed ``service`` package (a wheel's, not an
# editable install's: that one serves the checkout's dashboards/).
PACKAGE_DIR = "dashboard_files"


def vendor_packages() -> list[str]:
    return sorted({name.split("/")[0] for name in VENDOR_FILES})
