"""The command line of the test scripts that run one configuration, or several in one job
(tests share a job to save the ranks' start-up): ``script.py CONFIG_JSON OUT_DIR``, where
CONFIG_JSON is one object, or a list of objects each with a ``"name"`` whose results go to
OUT_DIR/<name>."""

import json
import os
import sys


def run_each(function) -> None:
    """Call ``function(config, out_dir)`` for the configuration(s) on the command line."""
    configs, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    if isinstance(configs, dict):
        function(configs, out_dir)
        return
    for config in configs:
        folder = os.path.join(out_dir, config["name"])
        os.makedirs(folder, exist_ok=True)
        function(config, folder)
