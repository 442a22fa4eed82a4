//! Shard-table wire encoding: round trips, the documented byte layout, one test per rejection
//! case (asserting kinds, never message text) and property tests over random and corrupted input.

use proptest::prelude::*;
use reshard_core::encoding::{
    decode_table, encode_table, table_from_json, table_to_json, MAGIC, MAX_NAME_LEN, SCHEMA_VERSION,
};
use reshard_core::{
    DType, Digest, ErrorKind, MemoryKind, OfferLocation, PartDigests, ShardOffer, ShardTable,
    TensorBox, TensorSpec,
};

// ---------------------------------------------------------------------------------------------
// Fixtures

fn offer(tensor: &str, offset: &[u64], extent: &[u64], at: u64, memory: MemoryKind) -> ShardOffer {
    ShardOffer {
        tensor: tensor.into(),
        tensor_box: TensorBox::new(offset.to_vec(), extent.to_vec()),
        location: OfferLocation {
            region: 7,
            offset: at,
            memory,
        },
        digest: None,
        parts: None,
    }
}

/// A small valid table: several dtypes, DRAM and VRAM offers, with and without digests.
fn sample() -> ShardTable {
    let mut t = ShardTable::new(3, "trainer-3", 1_234_567);
    t.tensors = vec![
        TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            DType::Bf16,
            vec![64, 32],
        ),
        TensorSpec::new(
            "model.layers.0.input_layernorm.weight",
            DType::F32,
            vec![32],
        ),
        TensorSpec::new(
            "model.layers.0.mlp.experts.w13",
            DType::F8E4m3,
            vec![4, 16, 32],
        ),
    ];
    let mut q0 = offer(&t.tensors[0].name, &[0, 0], &[32, 32], 0, MemoryKind::Dram);
    q0.digest = Some(Digest::of(b"q rows 0..32"));
    let q1 = offer(
        &t.tensors[0].name,
        &[32, 0],
        &[32, 32],
        2048,
        MemoryKind::Vram { device: 5 },
    );
    let mut ln = offer(
        &t.tensors[1].name,
        &[0],
        &[32],
        u64::MAX - 128,
        MemoryKind::Vram { device: u32::MAX },
    );
    ln.digest = Some(Digest::of(b"norm"));
    let w13 = offer(
        &t.tensors[2].name,
        &[1, 8, 0],
        &[2, 8, 32],
        1 << 40,
        MemoryKind::Dram,
    );
    t.offers = vec![q0, q1, ln, w13];
    t.validate().unwrap();
    t
}

/// A table with one f32 tensor `w` [4, 8] and one DRAM offer of `b` in it.
fn single(b: TensorBox) -> ShardTable {
    let mut t = ShardTable::new(9, "solo", 1);
    t.tensors.push(TensorSpec::new("w", DType::F32, vec![4, 8]));
    t.offers.push(ShardOffer {
        tensor: "w".into(),
        tensor_box: b,
        location: OfferLocation {
            region: 0,
            offset: 0,
            memory: MemoryKind::Dram,
        },
        digest: None,
        parts: None,
    });
    t
}

/// Builds raw encodings by hand, mirroring the documented layout (the tests' copy of the spec).
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(rank: u32, agent: &[u8], step: u64) -> Raw {
        Raw::header_bound(rank, agent, 0, step)
    }
    fn header_bound(rank: u32, agent: &[u8], incarnation: u64, step: u64) -> Raw {
        Raw::default()
            .bytes(&MAGIC)
            .u16(SCHEMA_VERSION)
            .u32(rank)
            .str(agent)
            .u64(incarnation)
            .u64(step)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u8(self, v: u8) -> Raw {
        self.bytes(&[v])
    }
    fn u16(self, v: u16) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn varint(mut self, mut v: u64) -> Raw {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
        self
    }
    fn str(self, s: &[u8]) -> Raw {
        self.varint(s.len() as u64).bytes(s)
    }
    fn tensor(self, name: &[u8], dtype_code: u8, shape: &[u64]) -> Raw {
        let mut r = self.str(name).u8(dtype_code).varint(shape.len() as u64);
        for &d in shape {
            r = r.varint(d);
        }
        r
    }
    /// An offer with its box; the caller appends region, offset, memory and digest.
    fn offer_box(self, index: u64, offset: &[u64], extent: &[u64]) -> Raw {
        let mut r = self.varint(index).varint(offset.len() as u64);
        for &o in offset {
            r = r.varint(o);
        }
        for &e in extent {
            r = r.varint(e);
        }
        r
    }
}

/// One declared f32 tensor `w` [4, 8], then the offer list begins (count 1).
fn raw_one_tensor_one_offer() -> Raw {
    Raw::header(9, b"solo", 1)
        .varint(1)
        .tensor(b"w", DType::F32.code(), &[4, 8])
        .varint(1)
}

fn decode_kind(bytes: &[u8]) -> ErrorKind {
    decode_table(bytes).unwrap_err().kind()
}

fn binary_kind(t: &ShardTable) -> ErrorKind {
    decode_kind(&encode_table(t))
}

// ---------------------------------------------------------------------------------------------
// Round trips and layout

#[test]
fn binary_round_trip_keeps_vram_devices_and_digests() {
    let t = sample();
    let bytes = encode_table(&t);
    assert_eq!(&bytes[..4], b"RSHT");
    let back = decode_table(&bytes).unwrap();
    assert_eq!(back, t);
    assert_eq!(
        back.offers[1].location.memory,
        MemoryKind::Vram { device: 5 }
    );
    assert_eq!(back.offers[0].digest, t.offers[0].digest);
    assert_eq!(encode_table(&back), bytes, "encoding is canonical");
}

#[test]
fn json_round_trip_keeps_vram_devices_and_digests() {
    let t = sample();
    let json = table_to_json(&t);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["schema_version"], u64::from(SCHEMA_VERSION));
    assert!(json.contains('\n'), "pretty-printed for people");
    let back = table_from_json(&json).unwrap();
    assert_eq!(back, t);
    assert_eq!(
        back.offers[2].location.memory,
        MemoryKind::Vram { device: u32::MAX }
    );
}

#[test]
fn empty_table_round_trips() {
    let t = ShardTable::new(0, "", 0);
    assert_eq!(decode_table(&encode_table(&t)).unwrap(), t);
    assert_eq!(table_from_json(&table_to_json(&t)).unwrap(), t);
}

#[test]
fn encoding_matches_the_documented_layout() {
    let mut t = ShardTable::new(0x0102_0304, "ag", 300).bound_to(0x1122_3344_5566_7788);
    t.tensors
        .push(TensorSpec::new("w", DType::Bf16, vec![200, 3]));
    let mut o = offer(
        "w",
        &[100, 0],
        &[100, 3],
        600,
        MemoryKind::Vram { device: 2 },
    );
    o.location.region = 1;
    o.digest = Some(Digest([0xab; 16]));
    o.parts = Some(PartDigests {
        chunk_rows: 50,
        chunks: vec![0xcdcd, 0xefef],
        block_cols: 2,
        blocks: vec![0x0101, 0x0202],
    });
    t.offers.push(o);
    let expected = Raw::header_bound(0x0102_0304, b"ag", 0x1122_3344_5566_7788, 300)
        .varint(1)
        .tensor(b"w", DType::Bf16.code(), &[200, 3])
        .varint(1)
        .offer_box(0, &[100, 0], &[100, 3])
        .varint(1) // region
        .varint(600) // byte offset
        .u8(1) // vram
        .varint(2) // device
        .u8(1) // digest present
        .bytes(&[0xab; 16])
        .u8(1) // part digests present
        .varint(50) // rows per chunk
        .varint(2) // chunks
        .bytes(&0xcdcd_u64.to_le_bytes())
        .bytes(&0xefef_u64.to_le_bytes())
        .varint(2) // columns per block
        .varint(2) // blocks
        .bytes(&0x0101_u64.to_le_bytes())
        .bytes(&0x0202_u64.to_le_bytes());
    let bytes = encode_table(&t);
    assert_eq!(bytes, expected.0);
    assert_eq!(
        bytes[..10],
        [b'R', b'S', b'H', b'T', 3, 0, 0x04, 0x03, 0x02, 0x01]
    );
    assert_eq!(decode_table(&bytes).unwrap(), t);
}

/// A Qwen3-30B-A3B-sized table: every tensor of the model offered by one publisher, q/k/v split
/// into 4 KV-group row blocks, bf16 in one VRAM region, every offer with a digest.
fn full_model_table() -> ShardTable {
    let mut t = ShardTable::new(0, "trainer-0", 1000);
    let push = |t: &mut ShardTable, name: String, shape: Vec<u64>, blocks: u64| {
        let spec = TensorSpec::new(name, DType::Bf16, shape);
        let rows = spec.shape[0] / blocks;
        for b in 0..blocks {
            let mut bx = spec.full_box();
            bx.offset[0] = b * rows;
            bx.extent[0] = rows;
            let at = t.offers.last().map_or(0, |o: &ShardOffer| {
                o.location.offset + o.tensor_box.elements() * 2
            });
            t.offers.push(ShardOffer {
                tensor: spec.name.clone(),
                tensor_box: bx,
                location: OfferLocation {
                    region: 0,
                    offset: at,
                    memory: MemoryKind::Vram { device: 0 },
                },
                digest: Some(Digest::of(at.to_le_bytes().as_slice())),
                parts: None,
            });
        }
        t.tensors.push(spec);
    };
    push(
        &mut t,
        "model.embed_tokens.weight".into(),
        vec![151_936, 2048],
        1,
    );
    for l in 0..48 {
        let p = format!("model.layers.{l}");
        push(
            &mut t,
            format!("{p}.self_attn.q_proj.weight"),
            vec![4096, 2048],
            4,
        );
        push(
            &mut t,
            format!("{p}.self_attn.k_proj.weight"),
            vec![512, 2048],
            4,
        );
        push(
            &mut t,
            format!("{p}.self_attn.v_proj.weight"),
            vec![512, 2048],
            4,
        );
        push(
            &mut t,
            format!("{p}.self_attn.o_proj.weight"),
            vec![2048, 4096],
            1,
        );
        push(&mut t, format!("{p}.self_attn.q_norm.weight"), vec![128], 1);
        push(&mut t, format!("{p}.self_attn.k_norm.weight"), vec![128], 1);
        push(&mut t, format!("{p}.input_layernorm.weight"), vec![2048], 1);
        push(
            &mut t,
            format!("{p}.post_attention_layernorm.weight"),
            vec![2048],
            1,
        );
        push(&mut t, format!("{p}.mlp.gate.weight"), vec![128, 2048], 1);
        for e in 0..128 {
            let x = format!("{p}.mlp.experts.{e}");
            push(&mut t, format!("{x}.gate_proj.weight"), vec![768, 2048], 1);
            push(&mut t, format!("{x}.up_proj.weight"), vec![768, 2048], 1);
            push(&mut t, format!("{x}.down_proj.weight"), vec![2048, 768], 1);
        }
    }
    push(&mut t, "model.norm.weight".into(), vec![2048], 1);
    push(&mut t, "lm_head.weight".into(), vec![151_936, 2048], 1);
    t
}

#[test]
fn full_model_table_is_compact() {
    let t = full_model_table();
    assert_eq!(t.tensors.len(), 18_867);
    assert_eq!(t.offers.len(), 19_299);
    let bytes = encode_table(&t);
    let names: usize = t.tensors.iter().map(|s| s.name.len()).sum();
    let mut no_offers = t.clone();
    no_offers.offers.clear();
    let offer_bytes = bytes.len() - encode_table(&no_offers).len();
    let mut no_digests = t.clone();
    no_digests.offers.iter_mut().for_each(|o| o.digest = None);
    let json = table_to_json(&t);
    eprintln!(
        "full model table: {} tensors, {} offers: binary {} bytes ({} bytes of tensor names, \
         {:.1} bytes per offer), {} bytes without digests; JSON {} bytes",
        t.tensors.len(),
        t.offers.len(),
        bytes.len(),
        names,
        offer_bytes as f64 / t.offers.len() as f64,
        encode_table(&no_digests).len(),
        json.len(),
    );
    // About 35 bytes per offer (16 of them digest) plus the tensor list, half of it names.
    assert!(bytes.len() < 1_700_000, "{} bytes", bytes.len());
    assert_eq!(decode_table(&bytes).unwrap(), t);

    // With the part digests publishers send (row chunks and column blocks on the standard
    // grid), against the schema-2 form they replace: eight 16-byte row-chunk digests on every
    // offer of two rows or more, behind a rows varint and a count varint.
    let mut parts = t.clone();
    for o in &mut parts.offers {
        let v = reshard_core::MatrixView::of(&o.tensor_box.extent);
        let elem = t
            .tensors
            .iter()
            .find(|s| s.name == o.tensor)
            .unwrap()
            .dtype
            .size();
        let (chunk_rows, block_cols) = v.grid(elem);
        o.parts = Some(PartDigests {
            chunk_rows,
            chunks: vec![u64::MAX; v.rows.div_ceil(chunk_rows) as usize],
            block_cols,
            blocks: vec![u64::MAX; v.cols.div_ceil(block_cols) as usize],
        });
    }
    let with_parts = encode_table(&parts).len();
    let varint = |v: u64| (64 - v.max(1).leading_zeros() as usize).div_ceil(7);
    let schema2: usize = bytes.len()
        + t.offers
            .iter()
            .map(|o| {
                let rows = o.tensor_box.extent[0];
                if rows < 2 {
                    return 0;
                }
                let per = rows.div_ceil(8);
                let n = rows.div_ceil(per);
                varint(per) + varint(n) + 16 * n as usize
            })
            .sum::<usize>();
    eprintln!(
        "with part digests: {with_parts} bytes ({:.1} per offer); schema 2 with eight row-chunk \
         digests: {schema2} bytes ({:.1} per offer): {:.2}x",
        (with_parts - encode_table(&no_offers).len()) as f64 / t.offers.len() as f64,
        (schema2 - encode_table(&no_offers).len()) as f64 / t.offers.len() as f64,
        with_parts as f64 / schema2 as f64
    );
    // docs/design.md §6 and BENCHMARKS.md: at most twice the table it replaces.
    assert!(with_parts <= 2 * schema2, "{with_parts} > 2 x {schema2}");
    assert_eq!(decode_table(&encode_table(&parts)).unwrap(), parts);
}

// ---------------------------------------------------------------------------------------------
// Rejections: malformed bytes are Decode errors

#[test]
fn rejects_bad_magic() {
    let mut bytes = encode_table(&sample());
    bytes[0] = b'X';
    assert_eq!(decode_kind(&bytes), ErrorKind::Decode);
    assert_eq!(decode_kind(b"PK\x03\x04 not a table"), ErrorKind::Decode);
}

#[test]
fn rejects_other_schema_versions() {
    let mut bytes = encode_table(&sample());
    for v in [0u16, SCHEMA_VERSION + 1, u16::MAX] {
        bytes[4..6].copy_from_slice(&v.to_le_bytes());
        assert_eq!(decode_kind(&bytes), ErrorKind::Decode, "version {v}");
    }
}

#[test]
fn rejects_every_truncation() {
    let bytes = encode_table(&sample());
    for n in 0..bytes.len() {
        let e = decode_table(&bytes[..n]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "truncated to {n} bytes");
    }
}

#[test]
fn truncation_errors_carry_the_owner_once_known() {
    let bytes = encode_table(&sample());
    let e = decode_table(&bytes[..bytes.len() - 3]).unwrap_err();
    assert_eq!(e.context().owner, Some(3));
    assert!(
        e.context().tensor.is_some(),
        "inside an offer the tensor is known"
    );
}

#[test]
fn rejects_trailing_bytes() {
    let mut bytes = encode_table(&sample());
    bytes.push(0);
    assert_eq!(decode_kind(&bytes), ErrorKind::Decode);
}

#[test]
fn rejects_invalid_utf8_in_agent() {
    let bytes = Raw::header(1, b"ag\xff\xfe", 0).varint(0).varint(0);
    assert_eq!(decode_kind(&bytes.0), ErrorKind::Decode);
}

#[test]
fn rejects_invalid_utf8_in_tensor_name() {
    let bytes = Raw::header(1, b"a", 0)
        .varint(1)
        .tensor(b"w\xc3\x28", DType::F32.code(), &[4])
        .varint(0);
    assert_eq!(decode_kind(&bytes.0), ErrorKind::Decode);
}

#[test]
fn rejects_unknown_dtype() {
    let bytes = Raw::header(1, b"a", 0)
        .varint(1)
        .tensor(b"w", DType::ALL.len() as u8, &[4])
        .varint(0);
    let e = decode_table(&bytes.0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Decode);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    assert_eq!(e.context().owner, Some(1));
}

#[test]
fn rejects_unknown_memory_tag() {
    let bytes = raw_one_tensor_one_offer()
        .offer_box(0, &[0, 0], &[4, 8])
        .varint(0)
        .varint(0)
        .u8(2) // neither dram (0) nor vram (1)
        .u8(0);
    let e = decode_table(&bytes.0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Decode);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    assert_eq!(e.context().owner, Some(9));
}

#[test]
fn rejects_vram_device_beyond_u32() {
    let bytes = raw_one_tensor_one_offer()
        .offer_box(0, &[0, 0], &[4, 8])
        .varint(0)
        .varint(0)
        .u8(1)
        .varint(u64::from(u32::MAX) + 1)
        .u8(0);
    assert_eq!(decode_kind(&bytes.0), ErrorKind::Decode);
}

#[test]
fn rejects_unknown_digest_flag() {
    let bytes = raw_one_tensor_one_offer()
        .offer_box(0, &[0, 0], &[4, 8])
        .varint(0)
        .varint(0)
        .u8(0)
        .u8(2)
        .bytes(&[0; 16]);
    assert_eq!(decode_kind(&bytes.0), ErrorKind::Decode);
}

#[test]
fn rejects_malformed_varints() {
    // A tensor count of eleven continuation bytes, then a non-minimal count (0x80 0x00).
    let overlong = Raw::header(1, b"a", 0).bytes(&[0xff; 11]);
    assert_eq!(decode_kind(&overlong.0), ErrorKind::Decode);
    let non_minimal = Raw::header(1, b"a", 0).bytes(&[0x80, 0x00]).varint(0);
    assert_eq!(decode_kind(&non_minimal.0), ErrorKind::Decode);
}

#[test]
fn huge_counts_are_rejected_before_allocating() {
    for count in [u64::MAX, u64::from(u32::MAX), 1 << 40] {
        let tensors = Raw::header(1, b"a", 0).varint(count);
        assert_eq!(decode_kind(&tensors.0), ErrorKind::Decode);
        let offers = Raw::header(1, b"a", 0).varint(0).varint(count);
        assert_eq!(decode_kind(&offers.0), ErrorKind::Decode);
        let rank = Raw::header(1, b"a", 0)
            .varint(1)
            .str(b"w")
            .u8(0)
            .varint(count);
        assert_eq!(decode_kind(&rank.0), ErrorKind::Decode);
        let agent = Raw::header(1, b"", 0);
        let mut agent = agent.0;
        agent.truncate(10);
        let agent = Raw(agent).varint(count).u64(0).varint(0).varint(0);
        assert_eq!(decode_kind(&agent.0), ErrorKind::Decode);
    }
}

#[test]
fn rejects_overlong_tensor_names() {
    let mut t = ShardTable::new(1, "a", 0);
    t.tensors.push(TensorSpec::new(
        "x".repeat(MAX_NAME_LEN + 1),
        DType::U8,
        vec![1],
    ));
    assert_eq!(binary_kind(&t), ErrorKind::Decode);
    assert_eq!(
        table_from_json(&table_to_json(&t)).unwrap_err().kind(),
        ErrorKind::Decode
    );
    t.tensors[0].name.truncate(MAX_NAME_LEN);
    assert!(decode_table(&encode_table(&t)).is_ok());
}

#[test]
fn refuses_to_expand_long_names_across_many_tiny_offers() {
    // Every decoded offer owns a copy of its tensor name: 200k six-byte offers of a 1 KiB name
    // would expand 1.2 MB of input into 200 MB of names.
    let n = 200_000;
    let mut raw = Raw::header(1, b"a", 0)
        .varint(1)
        .tensor(&[b'x'; MAX_NAME_LEN], DType::U8.code(), &[1])
        .varint(n);
    for _ in 0..n {
        raw = raw.bytes(&[0, 0, 0, 0, 0, 0]); // index 0, rank 0, region 0, offset 0, dram, none
    }
    assert_eq!(decode_kind(&raw.0), ErrorKind::Decode);
}

// ---------------------------------------------------------------------------------------------
// Rejections: well-formed encodings of invalid tables are InvalidTable errors

#[test]
fn rejects_tensor_index_out_of_range() {
    let bytes = raw_one_tensor_one_offer()
        .offer_box(1, &[0, 0], &[4, 8])
        .varint(0)
        .varint(0)
        .u8(0)
        .u8(0);
    let e = decode_table(&bytes.0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
    assert_eq!(e.context().owner, Some(9));
    // The encoder writes an offer of an undeclared tensor as an out-of-range index.
    let mut t = single(TensorBox::new(vec![0, 0], vec![4, 8]));
    t.offers[0].tensor = "undeclared".into();
    assert_eq!(binary_kind(&t), ErrorKind::InvalidTable);
    assert_eq!(
        table_from_json(&table_to_json(&t)).unwrap_err().kind(),
        ErrorKind::InvalidTable
    );
}

/// Binary and JSON both reject `t` as an invalid table naming tensor `w` and owner 9.
fn assert_invalid_table(t: &ShardTable) {
    let e = decode_table(&encode_table(t)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    assert_eq!(e.context().owner, Some(9));
    let e = table_from_json(&table_to_json(t)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
}

#[test]
fn rejects_box_outside_the_global_shape() {
    assert_invalid_table(&single(TensorBox::new(vec![2, 0], vec![4, 8])));
    assert_invalid_table(&single(TensorBox::new(vec![0, 8], vec![4, 1])));
}

#[test]
fn rejects_zero_extent_in_a_box() {
    assert_invalid_table(&single(TensorBox::new(vec![0, 0], vec![4, 0])));
}

#[test]
fn rejects_zero_extent_in_a_global_shape() {
    let mut t = single(TensorBox::new(vec![0, 0], vec![4, 8]));
    t.tensors[0].shape = vec![4, 0];
    assert_invalid_table(&t);
}

#[test]
fn rejects_extent_whose_end_overflows() {
    assert_invalid_table(&single(TensorBox::new(vec![0, u64::MAX], vec![4, 2])));
}

#[test]
fn rejects_byte_size_overflowing_u64() {
    // 2^63 elements fit u64, their 2^65 bytes of f32 do not.
    let mut t = single(TensorBox::new(vec![0, 0, 0], vec![1, 1, 1]));
    t.tensors[0].shape = vec![1 << 31, 1 << 31, 2];
    assert_invalid_table(&t);
    // The offer's byte range in its region overflows.
    let mut t = single(TensorBox::new(vec![0, 0], vec![4, 8]));
    t.offers[0].location.offset = u64::MAX - 64;
    assert_invalid_table(&t);
}

#[test]
fn rejects_box_rank_not_matching_shape_rank() {
    assert_invalid_table(&single(TensorBox::new(vec![0], vec![4])));
    assert_invalid_table(&single(TensorBox::new(vec![0, 0, 0], vec![4, 8, 1])));
    // Offsets and extents of different lengths cannot sneak through the encoder either.
    assert_invalid_table(&single(TensorBox::new(vec![0], vec![4, 8])));
    assert_invalid_table(&single(TensorBox::new(vec![0, 0], vec![4])));
}

#[test]
fn rejects_duplicate_tensor_names() {
    let mut t = single(TensorBox::new(vec![0, 0], vec![4, 8]));
    t.tensors.push(TensorSpec::new("w", DType::Bf16, vec![2]));
    assert_invalid_table(&t);
}

// ---------------------------------------------------------------------------------------------
// JSON-specific rejections

#[test]
fn json_rejects_other_schema_versions() {
    let json = table_to_json(&sample());
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for bad in [
        serde_json::json!(SCHEMA_VERSION - 1),
        serde_json::json!(SCHEMA_VERSION + 1),
        serde_json::json!(0),
        serde_json::json!(SCHEMA_VERSION.to_string()),
    ] {
        v["schema_version"] = bad.clone();
        let e = table_from_json(&v.to_string()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Decode, "schema_version {bad}");
    }
    v.as_object_mut().unwrap().remove("schema_version");
    assert_eq!(
        table_from_json(&v.to_string()).unwrap_err().kind(),
        ErrorKind::Decode
    );
}

#[test]
fn json_rejects_malformed_text() {
    for bad in [
        "",
        "{",
        "[]",
        r#"{"schema_version": 1}"#,
        r#"{"schema_version": 1, "table": {}}"#,
        r#"{"schema_version": 1, "table": null, "extra": 0}"#,
    ] {
        assert_eq!(
            table_from_json(bad).unwrap_err().kind(),
            ErrorKind::Decode,
            "{bad}"
        );
    }
    let deep = "[".repeat(100_000);
    assert_eq!(
        table_from_json(&deep).unwrap_err().kind(),
        ErrorKind::Decode
    );
}

// ---------------------------------------------------------------------------------------------
// Properties

/// Random valid tables: unique names, boxes inside their shapes, byte ranges inside u64.
fn valid_table() -> impl Strategy<Value = ShardTable> {
    let tensor = (
        0..DType::ALL.len(),
        prop::collection::vec(1u64..300, 1..4),
        "[a-z_.0-9]{0,12}",
    );
    let an_offer = (
        any::<usize>(),
        prop::collection::vec((any::<u64>(), any::<u64>()), 3),
        any::<u64>(),
        any::<u64>(),
        prop::option::of(any::<u32>()),
        prop::option::of(any::<[u8; 16]>()),
    );
    (
        any::<u32>(),
        "\\PC{0,12}",
        any::<u64>(),
        prop::collection::vec(tensor, 0..6),
        prop::collection::vec(an_offer, 0..24),
    )
        .prop_map(|(rank, agent, step, tensors, offers)| {
            let mut t = ShardTable::new(rank, agent, step);
            for (i, (dtype, shape, name)) in tensors.into_iter().enumerate() {
                t.tensors.push(TensorSpec::new(
                    format!("{name}#{i}"),
                    DType::ALL[dtype],
                    shape,
                ));
            }
            if t.tensors.is_empty() {
                return t;
            }
            for (pick, dims, region, at, device, digest) in offers {
                let spec = &t.tensors[pick % t.tensors.len()];
                let mut b = spec.full_box();
                for (d, &(o, e)) in dims.iter().take(spec.shape.len()).enumerate() {
                    b.offset[d] = o % spec.shape[d];
                    b.extent[d] = 1 + e % (spec.shape[d] - b.offset[d]);
                }
                let bytes = b.elements() * spec.dtype.size();
                t.offers.push(ShardOffer {
                    tensor: spec.name.clone(),
                    tensor_box: b.clone(),
                    location: OfferLocation {
                        region,
                        offset: at % (u64::MAX - bytes + 1),
                        memory: device
                            .map_or(MemoryKind::Dram, |device| MemoryKind::Vram { device }),
                    },
                    digest: digest.map(Digest),
                    // Derived from the digest bytes so the strategy stays small.
                    parts: digest.map(|d| {
                        let v = reshard_core::MatrixView::of(&b.extent);
                        let rows = 1 + u64::from(d[0]) % v.rows;
                        // At most PARTS_PER_AXIS blocks, as publishers cut rows (a finer
                        // grid is refused: `PartDigests::check_grid`).
                        let cols = (1 + u64::from(d[2]) % v.cols)
                            .max(v.cols.div_ceil(reshard_core::PARTS_PER_AXIS));
                        PartDigests {
                            chunk_rows: rows,
                            chunks: (0..v.rows.div_ceil(rows))
                                .map(|k| u64::from(d[1]) ^ k)
                                .collect(),
                            block_cols: cols,
                            blocks: (0..v.cols.div_ceil(cols))
                                .map(|k| u64::from(d[3]) << 8 ^ k)
                                .collect(),
                        }
                    }),
                });
            }
            t
        })
}

/// Random tables that are often invalid: tiny shapes and boxes, repeated or undeclared names.
fn any_table() -> impl Strategy<Value = ShardTable> {
    let names = prop::sample::select(vec!["a", "b", "c", ""]);
    let tensor = (names.clone(), prop::collection::vec(0u64..4, 0..3));
    let bx = (
        prop::collection::vec(prop_oneof![0u64..4, Just(u64::MAX)], 0..3),
        prop::collection::vec(prop_oneof![0u64..4, Just(u64::MAX)], 0..3),
    );
    let an_offer = (names, bx, prop_oneof![0u64..64, Just(u64::MAX - 2)]);
    (
        prop::collection::vec(tensor, 0..4),
        prop::collection::vec(an_offer, 0..4),
    )
        .prop_map(|(tensors, offers)| {
            let mut t = ShardTable::new(5, "p", 0);
            for (name, shape) in tensors {
                t.tensors.push(TensorSpec::new(name, DType::F32, shape));
            }
            for (name, (offset, extent), at) in offers {
                let mut o = offer(name, &offset, &extent, at, MemoryKind::Dram);
                o.location.region = 0;
                t.offers.push(o);
            }
            t
        })
}

/// Integration tests have no lib.rs for proptest's default persistence to anchor on; keep
/// failing seeds beside this file instead.
/// `PROPTEST_CASES` may raise `cases` for a longer run.
fn config(cases: u32) -> ProptestConfig {
    let default = ProptestConfig::default();
    ProptestConfig {
        cases: cases.max(default.cases),
        failure_persistence: Some(Box::new(
            prop::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..default
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn valid_tables_round_trip(t in valid_table()) {
        prop_assert!(t.validate().is_ok());
        let bytes = encode_table(&t);
        let back = decode_table(&bytes).unwrap();
        prop_assert_eq!(&back, &t);
        prop_assert_eq!(table_from_json(&table_to_json(&t)).unwrap(), t);
    }

    #[test]
    fn decoding_agrees_with_validate(t in any_table()) {
        match (t.validate(), decode_table(&encode_table(&t))) {
            (Ok(()), Ok(back)) => prop_assert_eq!(&back, &t),
            (Err(a), Err(b)) => {
                prop_assert_eq!(a.kind(), ErrorKind::InvalidTable);
                prop_assert_eq!(b.kind(), ErrorKind::InvalidTable);
            }
            (a, b) => prop_assert!(false, "validate {:?} but decode {:?}", a, b.map(|_| ())),
        }
        let json = table_from_json(&table_to_json(&t));
        prop_assert_eq!(json.map_err(|e| e.kind()).err(), t.validate().err().map(|e| e.kind()));
    }

}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn corrupted_bytes_never_panic(
        t in valid_table(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..6),
    ) {
        let bytes = encode_table(&t);
        let check = |b: &[u8]| -> Result<(), TestCaseError> {
            match decode_table(b) {
                // The encoding is canonical: anything accepted re-encodes to the same bytes.
                Ok(back) => prop_assert_eq!(encode_table(&back), b),
                Err(e) => prop_assert!(
                    matches!(e.kind(), ErrorKind::Decode | ErrorKind::InvalidTable),
                    "{:?}", e
                ),
            }
            Ok(())
        };
        check(&bytes[..cut.index(bytes.len() + 1)])?;
        let mut flipped = bytes.clone();
        for (i, x) in &flips {
            let i = i.index(flipped.len());
            flipped[i] ^= x;
        }
        check(&flipped)?;
        let mut both = flipped;
        both.truncate(cut.index(both.len() + 1));
        check(&both)?;
    }
}

fn chunked(rows: u64, count: usize) -> ShardTable {
    let mut t = ShardTable::new(3, "a", 1);
    t.tensors
        .push(TensorSpec::new("w", DType::Bf16, vec![200, 3]));
    let mut o = offer("w", &[0, 0], &[100, 3], 0, MemoryKind::Dram);
    o.parts = Some(PartDigests {
        chunk_rows: rows,
        chunks: (0..count as u64).collect(),
        block_cols: 2,
        blocks: vec![7, 8],
    });
    t.offers.push(o);
    t
}

#[test]
fn part_digests_round_trip_in_both_forms() {
    let t = chunked(13, 8);
    assert_eq!(decode_table(&encode_table(&t)).unwrap(), t);
    assert_eq!(table_from_json(&table_to_json(&t)).unwrap(), t);
}

#[test]
fn rejects_part_counts_that_do_not_match_the_box() {
    let e = decode_table(&encode_table(&chunked(13, 7))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
    assert_eq!(e.context().tensor.as_deref(), Some("w"));
    let mut t = chunked(13, 8);
    t.offers[0].parts.as_mut().unwrap().blocks.push(9);
    let e = decode_table(&encode_table(&t)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
}

#[test]
fn rejects_zero_rows_per_chunk() {
    let e = decode_table(&encode_table(&chunked(0, 0))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidTable);
}

#[test]
fn rejects_part_count_beyond_the_input() {
    let mut bytes = encode_table(&chunked(50, 2));
    // Drop the block digests and announce a huge count instead of 2.
    bytes.truncate(bytes.len() - 17);
    bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert_eq!(decode_table(&bytes).unwrap_err().kind(), ErrorKind::Decode);
}

#[test]
fn rejects_unknown_part_flag() {
    let mut bytes = encode_table(&chunked(50, 2));
    // The flag, then rows, count, two digests, columns, count, two digests.
    bytes.truncate(bytes.len() - (1 + 1 + 2 * 8 + 1 + 1 + 2 * 8) - 1);
    bytes.push(7);
    assert_eq!(decode_table(&bytes).unwrap_err().kind(), ErrorKind::Decode);
}
