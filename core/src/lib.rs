#![doc = include_str!("../README.md")]
// Unsafe code lives in `memory` alone: the raw host allocation transports write into, and the
// `unsafe trait MemoryBlock` whose contract they rely on.
#![deny(unsafe_code)]

pub mod completion;
pub mod config;
pub mod contract;
pub mod copyhash;
pub mod digest;
pub mod encoding;
pub mod error;
pub mod executed;
pub mod fault;
mod forward;
pub mod gate;
pub mod layout;
#[allow(unsafe_code)]
pub mod memory;
pub mod merge;
pub mod metadata;
mod metadata_tests;
pub mod model;
pub mod overlap;
pub mod plan;
pub mod prepared;
pub mod progress;
pub mod regions;
pub mod registry;
pub mod rendezvous;
pub mod stats;
pub mod transport;

pub use completion::{CompletionSink, Countdown};
pub use copyhash::{HashPlan, PieceHasher, SegmentTask};
pub use digest::{Digest, SegmentFold};
pub use error::{Error, ErrorContext, ErrorDetail, ErrorKind, NoRollback, NotApplicable, Result};
pub use layout::{ParamSpec, WantedCopy, WantedLayout};
pub use memory::{memory_check, BytesMut, BytesRef, HostBuffer, HostMemory, MemoryBlock};
pub use merge::{
    dedup, keep_all, merge, table_geometry_key, DedupOptions, DedupReport, MergedOffer,
    MergedTable, MergedTensor, ReplicaGroups,
};
pub use model::{
    offer_digest, DType, MatrixView, MemoryKind, OfferLocation, OwnerId, PartDigests, PublisherId,
    ShardOffer, ShardTable, TensorBox, TensorSpec, PARTS_PER_AXIS,
};
pub use plan::{
    CheckedPart, Dest, DigestCheck, Plan, PlanParam, PlanStats, PlannedRead, Reslice,
    StagingBuffer, StagingKind,
};
pub use stats::median;
pub use transport::{
    new_incarnation, Capability, ExecutionLog, InFlight, PreparedBatch, ReadBatch, ReadDesc,
    Registration, RemoteRows, RemoteRuns, Transport, WireReport,
};
