import torch
from pathkernels import _C
