"""`python -m runtime.launch_server`: the documented module entry point (same as `radixlm serve`).

The code lives in `runtime.entrypoints.launch_server`; this module only keeps the public command stable.
"""

from runtime.entrypoints.launch_server import main

if __name__ == "__main__":
    main()
