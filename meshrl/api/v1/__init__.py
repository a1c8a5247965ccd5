"""Generated gRPC stubs of the meshrl v1 API (source: protos/meshrl/api/v1). Do not edit."""

API_VERSION = "meshrl.api.v1"
