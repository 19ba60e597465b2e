"""Our top-level packages must not shadow, or be shadowed by, another installed distribution.

transformers >= 5.25 depends on Hugging Face's `kernels` distribution, which owns the top-level name
`kernels`; our attention backends are therefore `radixlm_kernels`. The checks run in a fresh interpreter
started outside the repository, as `radixlm serve` runs from an installed environment, so the current
directory cannot hide a collision.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json
out = {}
for name in ("runtime", "radixlm_kernels", "constrained", "lang", "kernels"):
    spec = importlib.util.find_spec(name)
    out[name] = spec.origin if spec else None
from transformers.utils import import_utils
out["transformers_sees_kernels"] = bool(import_utils.is_kernels_available())
from radixlm_kernels import create_backend  # noqa: F401  (what the model runner imports)
print(json.dumps(out))
"""


def test_installed_packages_resolve_to_this_repository_and_hf_kernels_to_its_own():
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd="/", env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("runtime", "radixlm_kernels", "constrained", "lang"):
        assert found[name] is not None and Path(found[name]).resolve().parent.parent == ROOT, (name, found)
    # Hugging Face's `kernels` (when installed) is its own, never a directory of this repository.
    if found["kernels"] is not None:
        assert "site-packages" in Path(found["kernels"]).parts, found
    assert not (ROOT / "kernels").exists(), "a top-level `kernels` package here would shadow Hugging Face's"
