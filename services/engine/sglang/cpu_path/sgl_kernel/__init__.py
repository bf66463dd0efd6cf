"""Import-only sgl_kernel for SGLang on CPU (see ../README.md). It registers no
`torch.ops.sgl_kernel` ops, so SGLang's CPU layers take their pure-torch paths."""

from _stub import install

install("sgl_kernel", NotImplementedError, {})
