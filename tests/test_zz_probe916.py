import os, sys
sys.path.insert(0, "/tmp")
import probe916  # noqa
import test_crosstalk_fuzz as t

def test_draw3(models, adapters):
    t.check_draw("qwen2.5-vl", models, adapters, 3)
from test_crosstalk_fuzz import models, adapters  # noqa
