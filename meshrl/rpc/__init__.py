"""gRPC plumbing shared by every service: channels, servers, health, error mapping."""
