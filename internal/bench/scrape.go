package bench

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"sort"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// buckets is one histogram as scraped: cumulative counts by upper bound.
type buckets map[float64]float64

// scrapeHistogram reads the histogram name from a server's /metrics.
func scrapeHistogram(ctx context.Context, base, name string) (buckets, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", base, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("%s/metrics: %w", base, err)
	}
	f, ok := families[name]
	if !ok || f.GetType() != dto.MetricType_HISTOGRAM {
		return nil, fmt.Errorf("%s/metrics has no histogram %s", base, name)
	}
	out := buckets{}
	for _, m := range f.GetMetric() {
		for _, b := range m.GetHistogram().GetBucket() {
			if !math.IsInf(b.GetUpperBound(), 1) {
				out[b.GetUpperBound()] += float64(b.GetCumulativeCount())
			}
		}
		out[math.Inf(1)] += float64(m.GetHistogram().GetSampleCount())
	}
	return out, nil
}

// quantile estimates the q-quantile (0 < q < 1) of the observations
// between two scrapes of one histogram, as Prometheus's
// histogram_quantile does: linearly within the bucket it falls in. It is
// NaN when nothing was observed.
func quantile(before, after buckets, q float64) float64 {
	bounds := make([]float64, 0, len(after))
	for b := range after {
		bounds = append(bounds, b)
	}
	sort.Float64s(bounds)
	total := after[math.Inf(1)] - before[math.Inf(1)]
	if total <= 0 {
		return math.NaN()
	}
	rank, lower, below := q*total, 0.0, 0.0
	for _, b := range bounds {
		n := after[b] - before[b]
		if n >= rank {
			if math.IsInf(b, 1) {
				return lower // past the last finite bound: its lower edge
			}
			return lower + (b-lower)*(rank-below)/math.Max(n-below, 1e-12)
		}
		lower, below = b, n
	}
	return lower
}
