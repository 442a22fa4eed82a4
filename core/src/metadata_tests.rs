//! [`metadata_tests!`](crate::metadata_tests), the unit tests every backend's metadata codec
//! shares, written once. A `macro_rules!` macro compiles nothing by itself: the tests exist only
//! where a backend expands it, inside its `#[cfg(test)]` module, so production builds carry no
//! test code.

/// Expands, inside a backend's `#[cfg(test)]` module of its metadata codec, to the tests every
/// codec must pass (docs/writing-a-backend.md, "The contract"):
///
/// - `round_trips`: `decode(encode(sample)) == sample`;
/// - `every_truncation_and_extension_is_a_decode_error`: every strict prefix of the encoding
///   is a `Decode` error naming `backend`, and the encoding with one byte more (made by
///   `extend`) is `MetaDefect::Trailing(1)`;
/// - `the_shared_header_is_checked_first`: a wrong magic, a wrong version and a name that is
///   not UTF-8 are the typed `HeaderError`s (`reseal` re-closes an edited encoding, for a
///   format with a checksum);
/// - `pseudo_random_garbage_never_panics`: garbage fails, garbage behind a valid magic and
///   version decodes or fails, and the sample with any one byte flipped decodes or fails,
///   never panicking;
/// - with `seed`, `the_fuzz_seed_is_the_encoders_output`: the checked-in fuzz seed (a path
///   relative to the repository) is the bytes `stored` keeps of the seed value's encoding,
///   rewritten under `UPDATE_SEEDS=1` after a format change, and the encoding decodes back.
///
/// `ty` names the codec: `<ty>::encode(&value) -> Bytes`, `<ty>::decode(&[u8]) ->
/// reshard_core::Result<ty>` and `<ty>::try_decode(&[u8]) -> Result<ty, MetaDefect<_>>`. The
/// expansion calls `env!("CARGO_MANIFEST_DIR")` of the crate expanding it, whose directory is
/// two levels below the repository's (`backends/<scheme>`).
#[macro_export]
macro_rules! metadata_tests {
    (
        ty: $ty:ty,
        backend: $backend:expr,
        sample: $sample:expr,
        extend: $extend:expr,
        reseal: $reseal:expr
        $(, seed: { path: $path:literal, value: $seed:expr, stored: $stored:expr $(,)? })?
        $(,)?
    ) => {
        #[test]
        fn round_trips() {
            let m: $ty = $sample;
            assert_eq!(<$ty>::decode(&<$ty>::encode(&m)).unwrap(), m);
        }

        #[test]
        fn every_truncation_and_extension_is_a_decode_error() {
            let full = <$ty>::encode(&$sample);
            for cut in 0..full.len() {
                let e = <$ty>::decode(&full[..cut]).unwrap_err();
                assert_eq!(e.kind(), $crate::ErrorKind::Decode, "cut at {cut}");
                assert_eq!(e.context().backend.as_deref(), Some($backend), "cut at {cut}");
            }
            let mut long = full.to_vec();
            let extend: fn(&mut Vec<u8>) = $extend;
            extend(&mut long);
            assert!(
                matches!(
                    <$ty>::try_decode(&long),
                    Err($crate::metadata::MetaDefect::Trailing(1))
                ),
                "one byte more is a trailing byte"
            );
        }

        #[test]
        fn the_shared_header_is_checked_first() {
            use $crate::metadata::{HeaderError, MetaDefect};
            let full = <$ty>::encode(&$sample).to_vec();
            let reseal: fn(&mut Vec<u8>) = $reseal;
            let edited = |at: usize, byte: u8| {
                let mut v = full.clone();
                v[at] = byte;
                reseal(&mut v);
                <$ty>::try_decode(&v)
            };
            assert!(matches!(
                edited(0, b'X'),
                Err(MetaDefect::Header(HeaderError::Magic { .. }))
            ));
            assert!(matches!(
                edited(4, 99),
                Err(MetaDefect::Header(HeaderError::Version { found: 99, .. }))
            ));
            // The name's first byte (after magic, version and its u16 length) made invalid UTF-8.
            assert!(matches!(
                edited(4 + 1 + 2, 0xff),
                Err(MetaDefect::Header(HeaderError::Name))
            ));
        }

        #[test]
        fn pseudo_random_garbage_never_panics() {
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            };
            let full = <$ty>::encode(&$sample).to_vec();
            for len in 0..400usize {
                let mut v: Vec<u8> = (0..len).map(|_| next()).collect();
                assert!(<$ty>::decode(&v).is_err(), "garbage of {len} bytes decoded");
                // Behind a valid magic and version, garbage still decodes or fails cleanly.
                if v.len() > 5 {
                    v[..5].copy_from_slice(&full[..5]);
                    let _ = <$ty>::decode(&v);
                }
                // So does the valid blob with one byte flipped.
                let mut w = full.clone();
                let at = len % w.len();
                w[at] ^= next() | 1;
                let _ = <$ty>::decode(&w);
            }
        }

        $(
            #[test]
            fn the_fuzz_seed_is_the_encoders_output() {
                let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../", $path);
                let seed: $ty = $seed;
                let encoded = <$ty>::encode(&seed);
                let stored: fn(&[u8]) -> &[u8] = $stored;
                let bytes = stored(&encoded);
                if std::env::var_os("UPDATE_SEEDS").is_some() {
                    let dir = std::path::Path::new(path).parent().unwrap();
                    std::fs::create_dir_all(dir).unwrap();
                    std::fs::write(path, bytes).unwrap();
                }
                assert_eq!(std::fs::read(path).unwrap(), bytes);
                assert_eq!(<$ty>::decode(&encoded).unwrap(), seed);
            }
        )?
    };
}
