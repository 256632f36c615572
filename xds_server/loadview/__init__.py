"""One load view across many gateways: the sum of every picker's live load (:mod:`.table`, pure)
and the gRPC service the pickers report to (:mod:`.service`, API ``protos/inferlb/v1/load_view.proto``)."""
