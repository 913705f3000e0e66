"""Suite-wide settings.

The models under test are tiny: their forwards are thousands of small tensor ops, which run
faster on one intra-op thread than on two (and CI has two cores, shared with tritonserver in the
end-to-end tests).
"""

import torch

torch.set_num_threads(1)
