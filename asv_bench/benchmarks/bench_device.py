"""Host-side cost of accepting caller arrays (paid on every put)."""

import numpy as np

from numbakv import device


class AsArray:
    params = ["float16", "float32", "bfloat16"]
    param_names = ["dtype"]

    def setup(self, dtype):
        storage = np.uint16 if dtype == "bfloat16" else dtype
        self.x = np.zeros((64, 8, 128), dtype=storage)

    def time_as_array_numpy(self, dtype):
        device.as_array(self.x, "cpu", dtype, name="key")
