#!/usr/bin/env bash
# Set up (first run only) and run the quickstart notebook headless; the executed notebook and an HTML copy go to out/.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mkdir -p out
jupyter nbconvert --to notebook --execute notebooks/00_quickstart.ipynb --output-dir out
jupyter nbconvert --to html out/00_quickstart.ipynb --output-dir out
echo "quickstart ran: executed notebook in out/00_quickstart.ipynb, readable copy in out/00_quickstart.html"
