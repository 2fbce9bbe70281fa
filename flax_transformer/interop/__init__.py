"""Weights in and out: how files are written (``files``), safetensors read and written tensor by
tensor (``safetensors_io``), torch <-> Flax porting (``porting``, ``layer_kinds``), HuggingFace
folders (``hf``, ``hf_tables``) and the library's own checkpoint files (``checkpoints``).

Imports ``models`` only. Writers here write bytes and do not judge them: the certificate that an
export was checked is made a layer up, in ``verification.export``, through the writers'
``sidecar`` hook. torch is imported lazily, inside the functions that read or write torch files.
"""
