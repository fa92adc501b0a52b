"""gRPC contracts of pdserve and their generated stubs.

Regenerate the stubs with `make protos` (python -m grpc_tools.protoc, see the Makefile);
tests/unit/test_protos.py fails when the committed stubs and the .proto files disagree.
"""
