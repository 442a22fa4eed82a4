//! Shared set-up of the wire-leg benches (`benches/wire.rs`): two endpoints of one backend in
//! this process, a registered publisher block and a registered receiver destination, connected
//! through exported and loaded metadata exactly as a receiver connects to its publishers, and
//! read batches of a given shape between them. Backend-agnostic: the bench creates the
//! endpoints, so this library needs no dependency on the native backends.

use std::sync::Arc;

use reshard_core::{
    Error, ErrorKind, HostBuffer, HostMemory, MemoryBlock, PreparedBatch, ReadBatch, ReadDesc,
    Registration, Result, Transport, WireReport,
};

/// Owner id the publisher endpoint is loaded under on the receiver.
const OWNER: u32 = 0;

/// One batch shape: `reads` equal reads of `read_bytes` each, laid end to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Short name ("large", "small").
    pub name: &'static str,
    /// Number of reads in the batch.
    pub reads: u64,
    /// Bytes per read.
    pub read_bytes: u64,
}

impl Shape {
    /// Total bytes the batch moves.
    pub fn bytes(&self) -> u64 {
        self.reads * self.read_bytes
    }

    /// Bench id naming the shape, e.g. `large_64x4MiB`.
    pub fn id(&self) -> String {
        format!("{}_{}x{}", self.name, self.reads, human(self.read_bytes))
    }
}

/// Large ranges: 64 reads of 4 MiB (256 MiB), what fused full pulls look like.
pub const LARGE: Shape = Shape {
    name: "large",
    reads: 64,
    read_bytes: 4 << 20,
};

/// Small ranges: 65,536 reads of 4 KiB (256 MiB), what an unfused plan of column slices
/// looks like.
pub const SMALL: Shape = Shape {
    name: "small",
    reads: 65_536,
    read_bytes: 4 << 10,
};

/// `4MiB`, `4KiB`, `512B`: the largest binary unit that divides `bytes`.
fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    UNITS
        .iter()
        .find(|(u, _)| bytes >= *u && bytes % u == 0)
        .map_or_else(|| format!("{bytes}B"), |(u, n)| format!("{}{n}", bytes / u))
}

/// The byte pattern of the publisher block: never zero, so an unwritten destination byte shows.
fn pattern(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// A publisher endpoint holding one registered block and a receiver endpoint holding one
/// registered destination of the same length, the receiver having loaded the publisher's
/// metadata.
pub struct WirePair {
    // Registrations first: fields drop in order, so they go before the memory and endpoints.
    src_reg: Registration,
    dst_reg: Registration,
    src: Arc<dyn HostMemory>,
    dst: Arc<HostBuffer>,
    src_from_backend: bool,
    publisher: Arc<dyn Transport>,
    receiver: Arc<dyn Transport>,
}

impl WirePair {
    /// Registers `len` bytes on each endpoint and connects them. The publisher block comes from
    /// [`Transport::allocate_host`] when the backend offers such memory (as the synthetic
    /// publishers do: it is UCX's shared-memory fast path), else it is a [`HostBuffer`]; the
    /// destination is a [`HostBuffer`], like a receiver's parameter banks. Both are written in
    /// full first, so no measured leg pays first-touch page faults.
    pub async fn connect(
        publisher: Arc<dyn Transport>,
        receiver: Arc<dyn Transport>,
        len: usize,
    ) -> Result<Self> {
        let (src, src_from_backend) = match publisher.allocate_host(len).await? {
            Some(m) => (m, true),
            None => (
                Arc::new(HostBuffer::zeroed(len)) as Arc<dyn HostMemory>,
                false,
            ),
        };
        for (i, b) in src.bytes_mut().iter_mut().enumerate() {
            *b = pattern(i);
        }
        let dst = Arc::new(HostBuffer::zeroed(len));
        dst.write().fill(0);
        let src_reg = publisher
            .register(src.clone() as Arc<dyn MemoryBlock>)
            .await?;
        let dst_reg = receiver
            .register(dst.clone() as Arc<dyn MemoryBlock>)
            .await?;
        receiver
            .load_peer(OWNER, publisher.export_metadata().await?)
            .await?;
        Ok(WirePair {
            src_reg,
            dst_reg,
            src,
            dst,
            src_from_backend,
            publisher,
            receiver,
        })
    }

    /// Backend name.
    pub fn backend(&self) -> &'static str {
        self.receiver.name()
    }

    /// Whether the publisher block came from the backend's `allocate_host`.
    pub fn src_from_backend(&self) -> bool {
        self.src_from_backend
    }

    /// The publisher endpoint.
    pub fn publisher(&self) -> &Arc<dyn Transport> {
        &self.publisher
    }

    /// The batch of `shape`: read `i` moves bytes `i * read_bytes..` to the same offset.
    pub fn batch(&self, shape: Shape) -> Result<ReadBatch> {
        if shape.bytes() > self.src_reg.len() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "shape {} moves {} bytes, the registered block holds {}",
                    shape.id(),
                    shape.bytes(),
                    self.src_reg.len()
                ),
            ));
        }
        let reads = (0..shape.reads)
            .map(|i| ReadDesc {
                owner: OWNER,
                remote_region: self.src_reg.id(),
                remote_offset: i * shape.read_bytes,
                local_region: self.dst_reg.id(),
                local_offset: i * shape.read_bytes,
                len: shape.read_bytes,
                remote_rows: None,
            })
            .collect();
        Ok(ReadBatch { reads })
    }

    /// Builds the descriptors of `shape` (the receiver's `prepare`).
    pub async fn prepare(&self, shape: Shape) -> Result<PreparedBatch> {
        self.receiver.prepare(self.batch(shape)?).await
    }

    /// The wire leg: posts a prepared batch and waits for it; a short byte count is an error
    /// (a bench of a backend that did not move the bytes measures nothing).
    pub async fn post_and_wait(&self, prepared: &PreparedBatch) -> Result<WireReport> {
        let report = self.receiver.post(prepared).await?.wait().await?;
        let planned = prepared.batch().bytes();
        if report.bytes != planned {
            return Err(Error::new(
                ErrorKind::Transport,
                format!("moved {} of {planned} bytes", report.bytes),
            )
            .with_backend(self.backend()));
        }
        Ok(report)
    }

    /// Clears the destination, runs one wire leg of `shape` and checks every byte it covers
    /// against the publisher block.
    pub async fn verify(&self, shape: Shape) -> Result<()> {
        self.dst.write().fill(0);
        let prepared = self.prepare(shape).await?;
        self.post_and_wait(&prepared).await?;
        let n = usize::try_from(shape.bytes())
            .map_err(|_| Error::new(ErrorKind::InvalidInput, "shape larger than memory"))?;
        let src = self.src.bytes();
        let dst = self.dst.read();
        match src[..n].iter().zip(&dst[..n]).position(|(a, b)| a != b) {
            None => Ok(()),
            Some(at) => Err(Error::new(
                ErrorKind::Verification,
                format!(
                    "{}: destination byte {at} differs from the source",
                    shape.id()
                ),
            )
            .with_backend(self.backend())),
        }
    }
}

/// The reference row: one thread copying `len` bytes between two resident buffers.
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    /// Two buffers of `len` bytes, both written once so their pages are resident.
    pub fn new(len: usize) -> Self {
        let src: Vec<u8> = (0..len).map(pattern).collect();
        let mut dst = vec![0u8; len];
        dst.copy_from_slice(&src);
        Memcpy { src, dst }
    }

    /// Copies the source over the destination once.
    pub fn run(&mut self) {
        self.dst.copy_from_slice(std::hint::black_box(&self.src));
        std::hint::black_box(&mut self.dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reshard_backend_loopback::{LoopbackFabric, LoopbackTransport};

    #[test]
    fn shape_ids_name_count_and_unit() {
        assert_eq!(LARGE.id(), "large_64x4MiB");
        assert_eq!(SMALL.id(), "small_65536x4KiB");
        assert_eq!(LARGE.bytes(), SMALL.bytes());
        assert_eq!(human(1536), "1536B");
        assert_eq!(human(1 << 30), "1GiB");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_loopback_pair_moves_every_byte_and_refuses_oversized_shapes() {
        let fabric = LoopbackFabric::new();
        let t = |name: &str| {
            Arc::new(LoopbackTransport::new(&fabric, name, 2).expect("loopback endpoint"))
                as Arc<dyn Transport>
        };
        let pair = WirePair::connect(t("publisher"), t("receiver"), 1 << 20)
            .await
            .expect("connect");
        assert_eq!(pair.backend(), "loopback");
        assert!(!pair.src_from_backend());
        let shape = Shape {
            name: "t",
            reads: 256,
            read_bytes: 4 << 10,
        };
        pair.verify(shape).await.expect("byte-exact");
        let too_big = Shape {
            reads: 257,
            ..shape
        };
        assert!(pair.batch(too_big).is_err());
    }
}
