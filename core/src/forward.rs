//! [`forward_transport!`](crate::forward_transport): how a `Transport` wrapper (recording,
//! fault injection, retry) forwards every method it does not change, so none can be forgotten.

/// Implements [`Transport`](crate::Transport) for a wrapper by forwarding every method to one of its fields,
/// except the methods written in the braces, which the wrapper implements itself:
///
/// ```ignore
/// reshard_core::forward_transport!(Recording => inner {
///     async fn post(&self, batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
///         self.posted.lock().push(batch.batch().clone());
///         self.inner.post(batch).await
///     }
/// });
/// ```
///
/// The field is anything that dereferences to a `Transport` (usually `Arc<dyn Transport>`).
/// Overrides are plain `fn` / `async fn` items (attributes allowed, no generics or `where`),
/// written as in an `#[async_trait] impl Transport`; the macro applies `async_trait` itself.
///
/// Why a macro: a hand-written wrapper has to repeat every method, and the methods with a
/// default (`allocate_host`, `set_execution_log`) compile when forgotten, silently turning a
/// wrapped endpoint into one without its shared memory or its execution log. Here every
/// method is listed once; the unit test `forward_transport_names_every_method` fails until a
/// method added to [`Transport`](crate::Transport) is added here too, and then every wrapper forwards it.
///
/// Each override and each trait method costs a few levels of macro recursion (about
/// 14 × (overrides + 2) in all), well inside the default limit of 128 for up to 6 overrides.
#[macro_export]
macro_rules! forward_transport {
    ($ty:ty => $field:ident { $($own:tt)* }) => {
        $crate::forward_transport!(@names [$ty, $field, { $($own)* }] [] $($own)*);
    };

    // Collects the names of the methods the wrapper writes itself.
    (@names $cx:tt [$($n:ident)*]
        $(#[$attr:meta])* $(async)? fn $name:ident $args:tt $(-> $ret:ty)? $body:block
        $($rest:tt)*) => {
        $crate::forward_transport!(@names $cx [$($n)* $name] $($rest)*);
    };
    (@names [$ty:ty, $field:ident, $own:tt] [$($n:ident)*]) => {
        $crate::forward_transport!(@next [$ty, $field, $own, [$($n)*]] []
            [name agent capabilities epoch incarnation peer_incarnation allocate_host register
             export_metadata load_peer prepare post post_reporting set_execution_log]);
    };

    // Takes the next trait method and looks it up among the overrides.
    (@next [$ty:ty, $field:ident, $own:tt, [$($n:ident)*]] $acc:tt [$m:ident $($ms:ident)*]) => {
        $crate::forward_transport!(@find $m [$($n)*] [$ty, $field, $own, [$($n)*]] $acc [$($ms)*]);
    };
    (@next [$ty:ty, $field:ident, { $($own:tt)* }, $names:tt] [$($acc:tt)*] []) => {
        #[$crate::transport::__private::async_trait]
        impl $crate::Transport for $ty {
            $($own)*
            $($acc)*
        }
    };

    // One pair of rules per trait method: skipped when the wrapper writes it (found at the head
    // of the override names), forwarded when the names ran out without it.
    (@find name [name $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find name [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn name(&self) -> &'static str {
                self.$f.name()
            }
        ] $todo);
    };
    (@find agent [agent $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find agent [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn agent(&self) -> &str {
                self.$f.agent()
            }
        ] $todo);
    };
    (@find capabilities [capabilities $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find capabilities [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn capabilities(&self) -> $crate::Capability {
                self.$f.capabilities()
            }
        ] $todo);
    };
    (@find epoch [epoch $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find epoch [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn epoch(&self) -> u64 {
                self.$f.epoch()
            }
        ] $todo);
    };
    (@find incarnation [incarnation $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find incarnation [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn incarnation(&self) -> u64 {
                self.$f.incarnation()
            }
        ] $todo);
    };
    (@find peer_incarnation [peer_incarnation $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find peer_incarnation [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn peer_incarnation(&self, owner: $crate::OwnerId) -> ::core::option::Option<u64> {
                self.$f.peer_incarnation(owner)
            }
        ] $todo);
    };
    (@find allocate_host [allocate_host $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find allocate_host [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn allocate_host(
                &self,
                len: usize,
            ) -> $crate::Result<
                ::core::option::Option<::std::sync::Arc<dyn $crate::HostMemory>>,
            > {
                self.$f.allocate_host(len).await
            }
        ] $todo);
    };
    (@find register [register $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find register [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn register(
                &self,
                block: ::std::sync::Arc<dyn $crate::MemoryBlock>,
            ) -> $crate::Result<$crate::Registration> {
                self.$f.register(block).await
            }
        ] $todo);
    };
    (@find export_metadata [export_metadata $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find export_metadata [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn export_metadata(&self) -> $crate::Result<$crate::transport::__private::Bytes> {
                self.$f.export_metadata().await
            }
        ] $todo);
    };
    (@find load_peer [load_peer $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find load_peer [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn load_peer(
                &self,
                owner: $crate::OwnerId,
                metadata: $crate::transport::__private::Bytes,
            ) -> $crate::Result<()> {
                self.$f.load_peer(owner, metadata).await
            }
        ] $todo);
    };
    (@find prepare [prepare $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find prepare [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn prepare(
                &self,
                batch: $crate::ReadBatch,
            ) -> $crate::Result<$crate::PreparedBatch> {
                self.$f.prepare(batch).await
            }
        ] $todo);
    };
    (@find post [post $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find post [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn post(
                &self,
                batch: &$crate::PreparedBatch,
            ) -> $crate::Result<::std::boxed::Box<dyn $crate::InFlight>> {
                self.$f.post(batch).await
            }
        ] $todo);
    };
    (@find post_reporting [post_reporting $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find post_reporting [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            async fn post_reporting(
                &self,
                batch: &$crate::PreparedBatch,
                sink: $crate::CompletionSink,
            ) -> $crate::Result<::std::boxed::Box<dyn $crate::InFlight>> {
                $crate::forward_transport!(@report self $f batch sink $n)
            }
        ] $todo);
    };
    // The body of a forwarded `post_reporting`: a wrapper that writes its own `post` posts
    // through it and reports nothing (the inner transport's reports would bypass whatever the
    // wrapper changes); otherwise the inner transport reports.
    (@report $s:tt $f:ident $batch:ident $sink:ident [post $($r:ident)*]) => {{
        let _ = $sink;
        $s.post($batch).await
    }};
    (@report $s:tt $f:ident $batch:ident $sink:ident [$h:ident $($r:ident)*]) => {
        $crate::forward_transport!(@report $s $f $batch $sink [$($r)*])
    };
    (@report $s:tt $f:ident $batch:ident $sink:ident []) => {
        $s.$f.post_reporting($batch, $sink).await
    };
    (@find set_execution_log [set_execution_log $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@next $cx $acc $todo);
    };
    (@find set_execution_log [] [$ty:ty, $f:ident, $own:tt, $n:tt] [$($acc:tt)*] $todo:tt) => {
        $crate::forward_transport!(@next [$ty, $f, $own, $n] [$($acc)*
            fn set_execution_log(
                &self,
                log: ::core::option::Option<::std::sync::Arc<$crate::ExecutionLog>>,
            ) -> bool {
                self.$f.set_execution_log(log)
            }
        ] $todo);
    };

    // Not at the head of the override names: look further.
    (@find $m:ident [$h:ident $($r:ident)*] $cx:tt $acc:tt $todo:tt) => {
        $crate::forward_transport!(@find $m [$($r)*] $cx $acc $todo);
    };
}

#[cfg(test)]
mod tests {
    use crate::completion::CompletionSink;
    use crate::error::Result;
    use crate::error::{Error, ErrorKind};
    use crate::memory::HostBuffer;
    use crate::memory::{HostMemory, MemoryBlock};
    use crate::model::OwnerId;
    use crate::transport::*;
    use async_trait::async_trait;
    use bytes::Bytes;
    use std::sync::Arc;

    /// A transport that only has what the defaulted methods can lose: its own host memory and
    /// an execution log. Everything else refuses.
    #[derive(Debug, Default)]
    struct Special {
        logging: parking_lot::Mutex<bool>,
    }

    fn refused() -> Error {
        Error::new(ErrorKind::Internal, "not part of this test")
    }

    #[async_trait]
    impl Transport for Special {
        fn name(&self) -> &'static str {
            "special"
        }
        fn agent(&self) -> &str {
            "special-agent"
        }
        fn capabilities(&self) -> Capability {
            Capability {
                one_sided_read: true,
                one_sided_write: false,
                vram: false,
                cross_process: false,
                max_reads_per_post: Some(7),
            }
        }
        fn epoch(&self) -> u64 {
            11
        }
        fn incarnation(&self) -> u64 {
            13
        }
        fn peer_incarnation(&self, owner: OwnerId) -> Option<u64> {
            Some(u64::from(owner) + 100)
        }
        async fn allocate_host(&self, len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
            Ok(Some(Arc::new(HostBuffer::zeroed(len))))
        }
        async fn register(&self, _block: Arc<dyn MemoryBlock>) -> Result<Registration> {
            Err(refused())
        }
        async fn export_metadata(&self) -> Result<Bytes> {
            Ok(Bytes::from_static(b"special"))
        }
        async fn load_peer(&self, _owner: OwnerId, _metadata: Bytes) -> Result<()> {
            Err(refused())
        }
        async fn prepare(&self, _batch: ReadBatch) -> Result<PreparedBatch> {
            Err(refused())
        }
        async fn post(&self, _batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            Err(refused())
        }
        async fn post_reporting(
            &self,
            _batch: &PreparedBatch,
            _sink: CompletionSink,
        ) -> Result<Box<dyn InFlight>> {
            Err(Error::new(ErrorKind::Internal, "posted reporting"))
        }
        fn set_execution_log(&self, log: Option<Arc<ExecutionLog>>) -> bool {
            *self.logging.lock() = log.is_some();
            true
        }
    }

    /// Forwards everything.
    #[derive(Debug)]
    struct Plain {
        inner: Arc<dyn Transport>,
    }
    crate::forward_transport!(Plain => inner {});

    /// Writes two methods itself, one of them defaulted in the trait.
    #[derive(Debug)]
    struct Overriding {
        inner: Arc<dyn Transport>,
    }
    crate::forward_transport!(Overriding => inner {
        fn epoch(&self) -> u64 {
            self.inner.epoch() + 1
        }
        async fn allocate_host(&self, _len: usize) -> Result<Option<Arc<dyn HostMemory>>> {
            Ok(None)
        }
    });

    /// Writes its own `post`: reads posted around it must not be reported by the inner one.
    #[derive(Debug)]
    struct OwnPost {
        inner: Arc<dyn Transport>,
    }
    crate::forward_transport!(OwnPost => inner {
        async fn post(&self, _batch: &PreparedBatch) -> Result<Box<dyn InFlight>> {
            Err(Error::new(ErrorKind::Internal, "own post"))
        }
    });

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn forwarding_wrapper_keeps_every_method_of_the_inner_transport() {
        let special = Arc::new(Special::default());
        let t: Arc<dyn Transport> = Arc::new(Plain {
            inner: Arc::new(Plain {
                inner: special.clone(),
            }),
        });
        assert_eq!(t.name(), "special");
        assert_eq!(t.agent(), "special-agent");
        assert_eq!(t.capabilities().max_reads_per_post, Some(7));
        assert_eq!((t.epoch(), t.incarnation()), (11, 13));
        assert_eq!(t.peer_incarnation(2), Some(102));
        block_on(async {
            let host = t.allocate_host(64).await.unwrap();
            assert_eq!(host.map(|h| h.len()), Some(64), "allocate_host forwarded");
            assert_eq!(&t.export_metadata().await.unwrap()[..], b"special");
            assert!(t.register(Arc::new(HostBuffer::zeroed(8))).await.is_err());
            assert!(t.load_peer(1, Bytes::new()).await.is_err());
            assert!(t.prepare(ReadBatch::default()).await.is_err());
            let batch = PreparedBatch::new(Arc::new(ReadBatch::default()), "special", ());
            assert!(t.post(&batch).await.is_err());
            let sink = CompletionSink::new(|_| {});
            let e = t.post_reporting(&batch, sink.clone()).await.err().unwrap();
            assert!(e.to_string().contains("posted reporting"), "forwarded: {e}");
            let own: Arc<dyn Transport> = Arc::new(OwnPost { inner: t.clone() });
            let e = own.post_reporting(&batch, sink).await.err().unwrap();
            assert!(
                e.to_string().contains("own post"),
                "through the wrapper's post: {e}"
            );
        });
        assert!(
            t.set_execution_log(Some(ExecutionLog::new())),
            "log forwarded"
        );
        assert!(*special.logging.lock());
    }

    #[test]
    fn forwarding_wrapper_uses_its_own_methods_where_it_writes_them() {
        let t = Overriding {
            inner: Arc::new(Special::default()),
        };
        assert_eq!(t.epoch(), 12);
        assert_eq!(t.incarnation(), 13);
        assert!(block_on(t.allocate_host(64)).unwrap().is_none());
    }

    /// The names of the `fn`s in the first `{ ... }` block after `start` in `src`.
    fn fn_names(src: &str, start: &str) -> std::collections::BTreeSet<String> {
        let at = src.find(start).expect(start);
        let open = at + src[at..].find('{').unwrap();
        let mut depth = 0usize;
        let mut end = open;
        for (i, c) in src[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + i;
                break;
            }
        }
        src[open..end]
            .split("fn ")
            .skip(1)
            .filter_map(|s| {
                let name: String = s
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let next = s[name.len()..].trim_start().chars().next();
                // A definition is followed by its arguments or generics; a bare identifier
                // there (`$name`, `fn` inside a comment) is no method.
                (matches!(next, Some('(' | '<')) && !name.is_empty()).then_some(name)
            })
            .collect()
    }

    #[test]
    fn forward_transport_names_every_method() {
        let trait_methods = fn_names(include_str!("transport.rs"), "pub trait Transport:");
        assert!(trait_methods.contains("allocate_host"), "{trait_methods:?}");
        let forwarded = fn_names(include_str!("forward.rs"), "macro_rules! forward_transport");
        assert_eq!(
            trait_methods, forwarded,
            "every Transport method must have its pair of rules in forward_transport!"
        );
    }
}
