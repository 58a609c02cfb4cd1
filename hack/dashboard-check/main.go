// dashboard-check checks Grafana dashboards (JSON) against Grafana's dashboard schema, as the
// Grafana Foundation SDK (github.com/grafana/grafana-foundation-sdk/go, Apache-2.0) generates it
// from Grafana's own schema: each file is decoded strictly into the SDK's dashboard type (a field
// the schema does not have, a required field missing or a value of the wrong type is an error),
// then the SDK's Validate runs its constraints. Panel options and field configs are decoded by
// the panel plugin's own types, and queries by their data source's. A panel type or a query the
// SDK does not know (whose fields nothing would check) and a variable of a type the schema does
// not list are errors here too.
//
// It is built, with the SDK version of hack/versions.env, by hack/build-dashboard-check.sh;
// tests/monitoring.rs runs it on the chart's dashboard.
//
//	dashboard-check FILE...
//
// Prints "FILE: ok (...)" for each valid file; otherwise each problem as "FILE: PATH: MESSAGE"
// on standard error, and exits 1.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/cog/variants"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

var variableTypes = map[dashboard.VariableType]bool{
	dashboard.VariableTypeQuery: true, dashboard.VariableTypeAdhoc: true, dashboard.VariableTypeGroupby: true,
	dashboard.VariableTypeConstant: true, dashboard.VariableTypeDatasource: true, dashboard.VariableTypeInterval: true,
	dashboard.VariableTypeTextbox: true, dashboard.VariableTypeCustom: true, dashboard.VariableTypeSystem: true,
	dashboard.VariableTypeSnapshot: true, dashboard.VariableTypeSwitch: true,
}

// problems lists an SDK error one line per problem, with its path in the dashboard. The SDK
// returns its (empty) error list as an error even when there is no problem.
func problems(err error) []string {
	if err == nil {
		return nil
	}
	var buildErrs cog.BuildErrors
	if errors.As(err, &buildErrs) {
		out := make([]string, 0, len(buildErrs))
		for _, e := range buildErrs {
			out = append(out, e.Error())
		}
		return out
	}
	return []string{err.Error()}
}

type rawPanel struct {
	Type       string                 `json:"type"`
	Datasource *struct{ Type string } `json:"datasource"`
	Targets    []json.RawMessage      `json:"targets"`
	Panels     []json.RawMessage      `json:"panels"` // a row's
}

// check returns the problems of one dashboard, and a summary when there are none.
func check(raw []byte) ([]string, string) {
	var d dashboard.Dashboard
	if found := problems(d.UnmarshalJSONStrict(raw)); len(found) > 0 {
		return found, ""
	}
	if found := problems(d.Validate()); len(found) > 0 {
		return found, ""
	}

	// What the strict decoding let through. The SDK's strict decoding reports the problems of
	// panels and queries but drops the panels and queries themselves (the same empty error list
	// taken for an error), so they are read from the JSON here.
	var out []string
	panels, queries := 0, 0
	var checkPanels func(prefix string, list []json.RawMessage)
	checkPanels = func(prefix string, list []json.RawMessage) {
		for i, one := range list {
			path := prefix + "panels[" + strconv.Itoa(i) + "]"
			var p rawPanel
			if err := json.Unmarshal(one, &p); err != nil {
				out = append(out, path+": "+err.Error())
				continue
			}
			if p.Type == "row" {
				checkPanels(path+".", p.Panels)
				continue
			}
			panels++
			if _, known := cog.ConfigForPanelcfgVariant(p.Type); !known {
				out = append(out, fmt.Sprintf("%s.type: panel type %q is not one the schema knows, so its options would go unchecked", path, p.Type))
			}
			hint := ""
			if p.Datasource != nil {
				hint = p.Datasource.Type
			}
			for j, target := range p.Targets {
				queries++
				// A query's own data source is the one Grafana sends it to.
				var own struct {
					Datasource *struct{ Type string } `json:"datasource"`
				}
				_ = json.Unmarshal(target, &own)
				queryHint := hint
				if own.Datasource != nil && own.Datasource.Type != "" {
					queryHint = own.Datasource.Type
				}
				q, err := cog.UnmarshalDataquery(target, queryHint)
				if err != nil {
					out = append(out, fmt.Sprintf("%s.targets[%d]: %v", path, j, err))
				} else if _, unknown := q.(variants.UnknownDataquery); unknown {
					out = append(out, fmt.Sprintf("%s.targets[%d]: a query of no data source type the schema knows (set datasource.type), so its fields would go unchecked", path, j))
				}
			}
		}
	}
	var layout struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &layout); err != nil {
		return []string{err.Error()}, ""
	}
	checkPanels("", layout.Panels)
	for i, v := range d.Templating.List {
		if !variableTypes[v.Type] {
			out = append(out, fmt.Sprintf("templating.list[%d].type: %q is not a variable type of the schema", i, v.Type))
		}
	}
	if len(out) > 0 {
		return out, ""
	}
	return nil, fmt.Sprintf("%d panels, %d queries, %d variables", panels, queries, len(d.Templating.List))
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: dashboard-check FILE...")
		os.Exit(2)
	}
	plugins.RegisterDefaultPlugins()
	failed := false
	for _, file := range os.Args[1:] {
		raw, err := os.ReadFile(file)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", file, err)
			failed = true
			continue
		}
		found, summary := check(raw)
		if len(found) > 0 {
			failed = true
			for _, p := range found {
				fmt.Fprintf(os.Stderr, "%s: %s\n", file, p)
			}
			continue
		}
		fmt.Printf("%s: ok (%s)\n", file, summary)
	}
	if failed {
		os.Exit(1)
	}
}
