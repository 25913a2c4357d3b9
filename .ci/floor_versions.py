"""Print the pip requirements of the floor job: each of torch, diffusers, transformers and
accelerate pinned at the floor that pyproject.toml declares (``torch>=2.5.1`` -> ``torch==2.5.1``)."""

import re
from pathlib import Path

FLOORED = ("torch", "diffusers", "transformers", "accelerate")
text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
floors = dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9.]+)[",]', text, re.M))
print(" ".join(f"{name}=={floors[name]}" for name in FLOORED))
