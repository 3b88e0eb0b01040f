"""The gRPC adapters of the trace process, one per service: protobuf to a handler call and back."""
