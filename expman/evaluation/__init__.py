"""The reference speculative decoder, the evaluate and benchmark stages, the integration-fault gate."""
