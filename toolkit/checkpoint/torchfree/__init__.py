"""The files torch writes, read and written without importing torch.

``import torch`` costs 1.3 s, more than copying a 1B model (issue 15), so a conversion that only
moves bytes file to file never imports it. This subpackage holds the layer that makes that
possible; none of its modules imports torch at import time (functions that hand out a torch
tensor import it when called, through ``toolkit.lazy.torch``):

  dtypes        dtypes by name (``DType``: name, item size, safetensors code)
  segments      byte ranges of files, copied file to file in the kernel
  torch_zip     the zip archive ``torch.save`` writes, byte for byte
  torch_record  ``torch.save`` records: written from byte ranges or plain objects, and a
                saved tensor's data located and read with one copy
  dcp_pickle    DCP's ``.metadata`` pickle, read and written through plain stand-ins
  safe_load     untrusted pickle files loaded without running code from them
"""
