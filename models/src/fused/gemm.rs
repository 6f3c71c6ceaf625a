//! Matrix products for the fused Linear, straight into the output's own buffer.
//!
//! Burn's Flex matmul makes its output with `FlexTensor::empty`: a zeroed byte vector, then
//! copied once more into an allocation aligned for any element type — two passes over every
//! output before the product writes it (6 % of the GPT's step on one device, the profile in
//! BENCHMARKS.md). Here the product writes a fresh `Vec<f32>` directly (the `gemm` crate that
//! Flex calls, with the same arguments), and a Linear's bias is the output's starting value
//! instead of a separate broadcast add.

use burn::backend::flex::FlexTensor;
use burn::tensor::DType;

/// A strided matrix operand: element `(i, j)` at `offset + i·row + j·col` of `data`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a> {
    data: &'a [f32],
    offset: usize,
    row: isize,
    col: isize,
    rows: usize,
    cols: usize,
}

impl<'a> Mat<'a> {
    /// A 2-d f32 tensor as it lies in memory. Strides must not be negative (a flipped view:
    /// make it contiguous first; [`super::ext`] does).
    pub(crate) fn of(t: &'a FlexTensor) -> Self {
        assert_eq!(t.dtype(), DType::F32, "fused Linear takes f32");
        let layout = t.layout();
        let (shape, strides) = (layout.shape(), layout.strides());
        assert_eq!(shape.num_dims(), 2, "a matrix operand is 2-d");
        assert!(strides.iter().all(|&s| s >= 0), "negative strides");
        let m = Self {
            data: t.storage::<f32>(),
            offset: layout.start_offset(),
            row: strides[0],
            col: strides[1],
            rows: shape[0],
            cols: shape[1],
        };
        m.check();
        m
    }

    /// `rows × cols` values of `data` from `offset`, a row every `row` values (columns next to
    /// each other).
    pub(crate) fn rows(
        data: &'a [f32],
        offset: usize,
        [rows, cols]: [usize; 2],
        row: usize,
    ) -> Self {
        let m = Self {
            data,
            offset,
            row: row as isize,
            col: 1,
            rows,
            cols,
        };
        m.check();
        m
    }

    /// The transpose, as a view.
    pub(crate) fn t(self) -> Self {
        Self {
            row: self.col,
            col: self.row,
            rows: self.cols,
            cols: self.rows,
            ..self
        }
    }

    /// `[rows, cols]`.
    pub(crate) fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// Every element it names lies inside `data` (what makes the raw reads below sound).
    fn check(&self) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let last = self.offset as isize
            + (self.rows - 1) as isize * self.row
            + (self.cols - 1) as isize * self.col;
        assert!(
            (last as usize) < self.data.len(),
            "a matrix view reaches past its storage"
        );
    }

    fn ptr(&self) -> *const f32 {
        self.data[self.offset..].as_ptr()
    }
}

/// `lhs · rhs` (`[m, k] · [k, n]`), row-major `[m, n]`, each row starting from `bias` when
/// there is one (`[n]`).
pub(crate) fn product(lhs: Mat, rhs: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    let ([m, k], [k2, n]) = (lhs.dims(), rhs.dims());
    assert_eq!(k, k2, "a product of [{m}, {k}] by [{k2}, {n}]");
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    if let Some(bias) = bias {
        assert_eq!(bias.len(), n, "a bias of {} for {n} outputs", bias.len());
        for _ in 0..m {
            out.extend_from_slice(bias);
        }
    }
    if m == 0 || n == 0 {
        return out;
    }
    if k == 0 && bias.is_some() {
        return out;
    }
    // SAFETY: `lhs` and `rhs` lie inside their storage (`Mat::check`); `out` has room for
    // `m·n` values, which `gemm` writes all of (reading them first only when it accumulates,
    // that is when the bias has set them), so its length may then be `m·n`.
    unsafe {
        raw_product(out.as_mut_ptr(), n, lhs, rhs, bias.is_some());
        out.set_len(m * n);
    }
    out
}

/// The sums of the columns of a row-major `[rows, n]` matrix: a bias's gradient.
pub(crate) fn column_sums(x: &[f32], n: usize) -> Vec<f32> {
    let mut sums = vec![0.0f32; n];
    for row in x.chunks_exact(n.max(1)) {
        for (s, v) in sums.iter_mut().zip(row) {
            *s += v;
        }
    }
    sums
}

/// `dst = lhs · rhs`, or `dst += lhs · rhs` when `accumulate`: `dst` holds the `[m, n]` result
/// from `offset`, a row every `row` values.
pub(crate) fn product_into(
    dst: &mut [f32],
    offset: usize,
    row: usize,
    lhs: Mat,
    rhs: Mat,
    accumulate: bool,
) {
    let ([m, k], [k2, n]) = (lhs.dims(), rhs.dims());
    assert_eq!(k, k2, "a product of [{m}, {k}] by [{k2}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        n <= row && offset + (m - 1) * row + n <= dst.len(),
        "a [{m}, {n}] result a row every {row} from {offset} of {} values",
        dst.len()
    );
    // SAFETY: the operands lie inside their storage (`Mat::check`), the result inside `dst`
    // (above), and `dst` is borrowed mutably, apart from them.
    unsafe { raw_product(dst[offset..].as_mut_ptr(), row, lhs, rhs, accumulate) }
}

/// `gemm`'s call for both products above: `[m, n]` at `dst`, a row every `row` values, set to
/// `lhs · rhs` or (`accumulate`) added to.
///
/// # Safety
/// `dst` must be valid for writes (and, when `accumulate`, reads) of the whole result, and not
/// overlap the operands.
unsafe fn raw_product(dst: *mut f32, row: usize, lhs: Mat, rhs: Mat, accumulate: bool) {
    let ([m, k], [_, n]) = (lhs.dims(), rhs.dims());
    // SAFETY: as the caller promises for `dst`; the operands were checked by `Mat::check`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            row as isize,
            accumulate,
            lhs.ptr(),
            lhs.col,
            lhs.row,
            rhs.ptr(),
            rhs.col,
            rhs.row,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}
