"""Generated gRPC stubs (scripts/gen_proto.py). Do not edit."""
