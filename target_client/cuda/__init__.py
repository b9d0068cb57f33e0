"""The client's device side (transport "cuda_ipc"): the CUDA IPC buffer it exports and the copies
into it (``ipc``). Imports torch inside functions only, and only a client whose transport is
cuda_ipc gets here; the rest of the client never imports torch.
"""
