"""expbuf server side: durable storage of experiences and, later, the gRPC service."""
