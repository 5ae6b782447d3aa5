"""``python -m pipeline.models``: build (or check) the built-in models and print where they are."""

from pipeline.models.load import main

main()
