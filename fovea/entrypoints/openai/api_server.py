"""`python -m fovea.entrypoints.openai.api_server --model M ...`: vLLM's older module entry point (Dockerfiles and
seed 000's launch line use it), the same as `fovea serve M ...`."""

from __future__ import annotations

import sys

from fovea.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]])
